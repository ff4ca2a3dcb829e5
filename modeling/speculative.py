"""Lossless early exit, `exit_mode="speculative"`: the exits draft, the layers they skipped verify.

Each round, every unfinished row drafts up to k tokens (`num_assistant_tokens`) with the decoder's exits, one
decoding step per token, through an `EarlyExitCache` with `kv_strategy="recompute"`: a draft's K/V are exact in the
layers it ran, and no draft goes deeper than an earlier draft of its round (`CappedDraft`), so nothing is caught up
one token at a time. The verification is one more step, at full depth: it feeds the last drafts of rows still
drafting and, layer by layer, runs every waiting draft through the layers it skipped. Afterwards every slot holds
the K/V of a full-depth pass, and the cache's waiting states hold each draft's final-layer output; the final head on
them gives the full model's distribution after each drafted prefix (a draft that ran every layer had it already).
Nothing runs twice.

Acceptance is Leviathan et al.'s: greedy keeps the longest run of drafts equal to the full model's argmax, then adds
the full model's own token; sampling accepts a draft x with probability min(1, p(x) / q(x)) and on the first rejection
samples from normalise(max(0, p - q)). p and q are the distributions after the call's logits processors, each on its
row's own prefix, so the output is the full model's: token for token when greedy, in distribution when sampling.
That holds for processors and stopping criteria that are functions of a row's own tokens, as in Transformers'
assisted decoding: they are called at every drafted and verified position, so one that counts its calls or reads
the other rows (which stand at other lengths) sees what the full model's loop would not show it.

Rows advance independently. A round opens k + 1 slots in every row; the slots of a row's rejected drafts become holes,
masked in the decoder's attention mask and skipped by its position ids (which count each row's real tokens). Holes
that every row has at the end of a round are cropped, so at batch 1 nothing of a rejected draft remains. A row that
finished leaves the decoder's batch (`LiveRows`): at small model sizes a layer's cost grows with its rows, and rows
end far apart (captions at batch 8-16: a third of a call's row-rounds came after a row's end). The rounds'
bookkeeping keeps the whole batch, so logits processors and stopping criteria see every row as in stock `generate`.
At the end of the call the rows that left rejoin the cache, each row's real slots move to its first positions, and
those past a row's end wait for the layers with the tokens the full model feeds there (its last token, then pads):
the returned cache stands for the full model's.
"""

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .exit_controllers import ExitController, ExitState, checked_decision
from .row_exits import select_rows

DEFAULT_DRAFT_TOKENS = 4  # when the generation config leaves `num_assistant_tokens` unset
# A round goes on drafting only while more than this fraction of its rows still draft: a step costs the batch about
# what it costs one row, so the rows that stopped would ride along. Measured on the embedded model's captions at
# batch 8 and 16: 0.7x the full model when rounds ran until every row stopped, 0.9x with this rule. Rows whose drafts
# ended (an end token, the length limit) leave the count while every row still drafting has room for more than a
# round: a longer round then saves later ones (captions at batch 16: 43 rounds instead of 56, 1.04-1.09x as fast),
# whereas rows that will end within a round anyway (short answers) would only draft more.
ROUND_GOES_ON = 0.9


@dataclass
class Draft:
    """One drafting step of a round, per row: the drafted token, its raw logits and processed scores (q), the layer
    it came from, and the final-LayerNorm'd state its logits project."""

    tokens: torch.Tensor  # [batch]
    logits: torch.Tensor  # [batch, vocab]
    scores: torch.Tensor  # [batch, vocab]
    exit_layers: torch.Tensor  # [batch]
    hidden_states: torch.Tensor  # [batch, d]


class RowTokens:
    """Each row's decoder tokens so far, left-aligned in one buffer with room for a round's drafts, and its length.
    A row's drafts are written after its tokens, so that its prefixes are slices of the buffer."""

    def __init__(self, input_ids: torch.Tensor, capacity: int, pad_token_id: int):
        batch, length = input_ids.shape
        self.pad_token_id = pad_token_id
        self.buffer = input_ids.new_full((batch, max(capacity, length)), pad_token_id)
        self.buffer[:, :length] = input_ids
        self.lengths = [length] * batch
        self.start = length

    def grow(self, needed: int) -> None:
        if needed > self.buffer.shape[1]:
            self.buffer = F.pad(self.buffer, (0, needed - self.buffer.shape[1]), value=self.pad_token_id)

    def write(self, rows: list[int], offset: int, tokens: torch.Tensor) -> None:
        """Token `tokens[row]` at each row's length + `offset`."""
        self.grow(max(self.lengths) + offset + 1)
        columns = [self.lengths[row] + offset for row in rows]
        if len(rows) == len(self.lengths) and min(columns) == max(columns):  # every row, one column (batch 1)
            self.buffer[:, columns[0]] = tokens
            return
        index = torch.tensor(rows, device=self.buffer.device)
        self.buffer[index, torch.tensor(columns, device=self.buffer.device)] = tokens[index]

    def by_length(self, rows: list[int], offset: int = 0) -> dict[int, list[int]]:
        """`rows` grouped by their length + `offset`: the rows whose prefixes fit one tensor."""
        groups: dict[int, list[int]] = defaultdict(list)
        for row in rows:
            groups[self.lengths[row] + offset].append(row)
        return groups

    def new_tokens(self) -> torch.Tensor:
        """[batch, start + longest]: the decoder's input tokens then each row's new ones, padded."""
        longest = max(self.lengths)
        sequences = self.buffer[:, :longest].clone()
        for row, length in enumerate(self.lengths):
            sequences[row, length:] = self.pad_token_id
        return sequences


def profiled(name: str) -> contextlib.AbstractContextManager:
    """`record_function(name)` while a torch profiler runs: where a round's time goes (`bench` reads it). Otherwise
    nothing, since entering one costs two operator calls, and a round enters several."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def processed(processors: Callable, tokens: RowTokens, rows: list[int], offset: int, logits: torch.Tensor):
    """The logits processors applied to the `rows` of `logits` [batch, vocab], each on its own prefix (its tokens and
    `offset` drafts); the other rows keep their logits. As in stock `generate`, every call sees the whole batch in
    batch order, since a processor may key on a row's index (`prefix_allowed_tokens_fn` does): one call per prefix
    length among the rows, keeping the rows of that length."""
    if not processors:
        return logits
    groups = tokens.by_length(rows, offset)
    if len(groups) == 1 and len(rows) == logits.shape[0]:
        return processed_batch(processors, tokens.buffer[:, : next(iter(groups))], logits)
    scores = logits.clone()
    for length, group in groups.items():
        index = torch.tensor(group, device=logits.device)
        scores[index] = processed_batch(processors, tokens.buffer[:, :length], logits)[index]
    return scores


def processed_batch(processors: Callable, prefixes: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The processors on the whole batch's `prefixes` [batch, length] and a copy of `logits` [batch, vocab]: a
    processor may write into its scores, and `logits` are the raw logits the round keeps (and other lengths use)."""
    scores = logits.clone()
    for processor in processors:  # `LogitsProcessorList.__call__` minus its signature check per call
        scores = processor(prefixes, scores)
    return scores


class SlotMask:
    """The decoder's attention mask over the cache's slots and the position ids of a batch with holes; None for both
    while no row has a hole or a prompt pad (then positions are the slots). A hole counts no position; a padded
    decoder prompt's pads are masked, and those after a row's first real token count, as the full model counts them
    (`position_ids_from_mask`)."""

    def __init__(self, max_length: int, prompt_mask: torch.Tensor | None = None) -> None:
        # A row's real tokens take positions up to max_length - 2 (the newest token is never fed). A slot of a row
        # that no longer drafts in its round counts too, past them maybe: clamped, since no kept token reads it.
        self.last_position = max(max_length - 2, 0)
        self.mask: torch.Tensor | None = None  # [batch, slots]
        self.counted: torch.Tensor | None = None  # [batch, slots]: 1 where a slot counts toward the positions
        if prompt_mask is not None and not bool(prompt_mask.all()):
            self.mask = prompt_mask.long()
            self.counted = (self.mask.cumsum(dim=-1) > 0).long()

    def covering(self, slots: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention mask, position ids) [batch, slots] over the first `slots` slots, the ones after the last round
        real."""
        if self.mask is None:
            return None, None
        mask, counted = (F.pad(tensor, (0, slots - tensor.shape[1]), value=1) for tensor in (self.mask, self.counted))
        return mask, (counted.cumsum(dim=-1) - 1).clamp(min=0, max=self.last_position)

    def close_round(self, slots: int, real: list[int], start: int, device: torch.device) -> int:
        """After a round whose slots start at `start` (of `slots`), the first `real[row]` of them real and the rest
        holes: returns how many trailing slots are holes in every row, to crop."""
        keep = max(real)
        opened = slots - start
        if self.mask is None and all(count == keep for count in real):
            return opened - keep
        if self.mask is None:
            self.mask = self.counted = torch.ones(len(real), start, dtype=torch.long, device=device)
        new = (torch.arange(keep, device=device)[None] < torch.tensor(real, device=device)[:, None]).long()
        # The round's first slot may be the prompt's last token (the first round's input): its own values stay.
        self.mask, self.counted = (
            F.pad(tensor, (0, start + keep - tensor.shape[1]), value=1) for tensor in (self.mask, self.counted)
        )
        self.mask[:, start:] *= new
        self.counted[:, start:] *= new
        return opened - keep


@dataclass
class RoundSlots:
    """A round's decoder mask and position ids over the slots it may open (`SlotMask.covering`, None for both while
    no row has a hole), and the position terms of its queries there (`DecoderStepBiases`): computed once, and each
    draft step and the verification takes its own part."""

    mask: torch.Tensor | None
    positions: torch.Tensor | None
    biases: Any  # a `DecoderStepBiases` (modeling_ofa imports this module)

    def covering(self, slots: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The mask and position ids over the first `slots` slots."""
        return tuple(None if tensor is None else tensor[:, :slots] for tensor in (self.mask, self.positions))


class CappedDraft(ExitController):
    """The drafts' controller in a round, with each row also stopped once it reaches its cap: the shallowest exit of
    the round's earlier drafts (`capped_at` sets them before each draft step). A draft then never needs a layer that
    an earlier draft skipped (which would run that layer on the earlier draft, one token at a time): the
    verification runs them all at once. Where finished rows left the decoder's batch (`live`: the call's row of each
    decoder row), it hands the controller the call's rows, as per-row thresholds are given."""

    def __init__(self, controller: ExitController, caps: torch.Tensor, live: torch.Tensor | None = None):
        self.controller = controller
        self.live = live
        self.capped_at(caps)

    def capped_at(self, caps: torch.Tensor) -> None:
        """The caps [batch] of the next draft step."""
        self.caps = caps
        self.forced = torch.zeros_like(caps, dtype=torch.bool)  # rows it stopped at their cap against the controller

    def __call__(self, state: ExitState) -> torch.BoolTensor:
        if self.live is not None:  # the logits stay computed once, on the decoder's state
            state = dataclasses.replace(state, rows=self.live[state.rows], logits_fn=state.logits)
        ready = checked_decision(self.controller(state), state, self.controller)
        if state.rows.shape[0] == self.caps.shape[0]:  # every row still runs (always at batch 1): no gathers
            capped = self.caps <= state.layer
            self.forced = capped & ~ready
        else:
            capped = self.caps[state.rows] <= state.layer
            self.forced[state.rows] = capped & ~ready
        return ready | capped


class LiveRows:
    """The rows of a call that the decoder runs on, ascending: a round's bookkeeping (tokens, logits processors,
    acceptance) keeps the whole batch, and finished rows leave the decoder's batch (`SpeculativeDecoding.keep_rows`).
    `select_rows(tensor, index)` takes the decoder's rows of a [batch, ...] tensor, `scatter` puts them back."""

    def __init__(self, batch: int):
        self.batch = batch
        self.rows = list(range(batch))
        self.index: torch.Tensor | None = None  # None while every row is live: no gathers

    def keep(self, rows: list[int], device: torch.device) -> None:
        """From now on the decoder runs on the call's `rows` (ascending)."""
        self.rows = rows
        self.index = torch.tensor(rows, device=device)

    def scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, ...] -> [batch, ...], zeros at the rows that left."""
        if self.index is None:
            return tensor
        batch = tensor.new_zeros((self.batch, *tensor.shape[1:]))
        batch[self.index] = tensor
        return batch


@dataclass
class DepartedRows:
    """Rows that left the decoder's batch, with their self-attention cache as it stood then (keys and values per layer,
    `recompute`'s frontier and waiting states): the cache the call returns holds them again (`rejoin`)."""

    index: torch.Tensor
    key_values: list[tuple[torch.Tensor, torch.Tensor]]
    frontier: torch.Tensor
    pending: torch.Tensor


@dataclass
class RoundResult:
    """What a round gives each row: `tokens` [batch, K + 1] of which the first `accepted[row] + 1` are emitted, their
    exit layers, the processed full-model scores and raw logits at each, and how many drafts it kept and accepted."""

    tokens: torch.Tensor
    exit_layers: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor
    accepted: torch.Tensor
    drafted: torch.Tensor


def accept_greedy(
    drafts: torch.Tensor, p_scores: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [batch, K] of which each row keeps its first `kept` [batch], full-model scores [batch, K + 1, vocab]
    -> (accepted drafts per row [batch], the token after them [batch]): the longest run of kept drafts equal to the
    full model's argmax, then the full model's argmax."""
    target = p_scores.argmax(dim=-1)
    counted = torch.arange(drafts.shape[1], device=drafts.device)[None] < kept[:, None]
    accepted = ((drafts == target[:, :-1]) & counted).long().cumprod(dim=-1).sum(dim=-1)
    return accepted, target.gather(1, accepted[:, None])[:, 0]


def accept_sampled(
    drafts: torch.Tensor, q_scores: torch.Tensor, p_scores: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: drafts [batch, K] drawn from softmax(q_scores) [batch, K, vocab], each row keeping its
    first `kept` [batch]; full-model scores [batch, K + 1, vocab]. A draft x is accepted with probability
    min(1, p(x) / q(x)); at a row's first rejection its token is drawn from normalise(max(0, p - q)), after all its
    drafts are accepted from the next p."""
    p = p_scores.softmax(dim=-1)
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    if drafts.shape[1] == 0:
        return kept, torch.multinomial(p[:, 0], num_samples=1)[:, 0]
    q = q_scores.softmax(dim=-1)
    ratio = p[:, :-1].gather(-1, drafts[..., None])[..., 0] / q.gather(-1, drafts[..., None])[..., 0]
    counted = torch.arange(drafts.shape[1], device=drafts.device)[None] < kept[:, None]
    accepted = ((torch.rand_like(ratio) <= ratio) & counted).long().cumprod(dim=-1).sum(dim=-1)
    at = accepted.clamp(max=drafts.shape[1] - 1)
    residual = (p[rows, at] - q[rows, at]).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    rejected = (accepted < kept)[:, None] & (total > 0)  # p == q leaves nothing to draw from: then p itself
    target = torch.where(rejected, residual / total.clamp(min=torch.finfo(total.dtype).tiny), p[rows, accepted])
    return accepted, torch.multinomial(target, num_samples=1)[:, 0]


@dataclass
class SpeculativeDecoding:
    """One speculative `generate` call: the decoder, its cache (`recompute`) and the encoder outputs, the settings
    the drafts run under (`EarlyExitSettings.drafting`, with the call's decoder controller), and the call's logits
    processors and sampling choice."""

    decoder: torch.nn.Module
    cache: object
    encoder_outputs: object
    drafting: object
    processors: Callable
    do_sample: bool
    pad_token_id: int
    eos_token_ids: torch.Tensor | None  # a row that drafts one stops drafting: nothing after it would be kept
    max_length: int  # so does a row whose drafts reach it (a longer row than the one that set the round's k)
    live: LiveRows = dataclasses.field(init=False)
    departed: list[DepartedRows] = dataclasses.field(init=False, default_factory=list)
    cross_key_values: list[tuple[torch.Tensor, torch.Tensor]] | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.live = LiveRows(self.encoder_outputs.last_hidden_state.shape[0])

    @property
    def depth(self) -> int:
        return len(self.decoder.layers)

    def round_slots(self, slots: SlotMask, start: int, count: int) -> RoundSlots:
        """The `RoundSlots` of a round that opens `count` slots from slot `start`, for the decoder's rows."""
        mask, positions = (select_rows(tensor, self.live.index) for tensor in slots.covering(start + count))
        if positions is None and self.live.index is not None:  # rows keep a step each, also before the first hole
            positions = torch.arange(start + count, device=self.live.index.device).expand(len(self.live.rows), -1)
        biases = self.decoder.step_biases(
            start, count, start + count, mask, self.encoder_outputs, self.cache.self_attention_cache, positions
        )
        return RoundSlots(mask, positions, biases)

    def draft(
        self, tokens: torch.Tensor, round_slots: RoundSlots, settings: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One drafting step of every row on `tokens` [batch] under the draft `settings` (`EarlyExitSettings`, whose
        decoder controller is a `CappedDraft`): (logits [batch, vocab] over the draft vocabulary, exit layers [batch],
        the final-LayerNorm'd states [batch, d] the logits project)."""
        mask, positions = round_slots.covering(self.cache.get_seq_length() + 1)
        with profiled("speculative.draft"):
            out = self.decoder(
                select_rows(tokens, self.live.index)[:, None], self.encoder_outputs, mask, self.cache, settings,
                position_ids=positions, step_biases=round_slots.biases,
            )  # fmt: skip
            hidden_states = out.last_hidden_state[:, -1]
            if out.logits is not None:
                logits = out.logits[:, -1]
            else:
                vocabulary = self.decoder.draft_vocabulary(settings, self.cache.self_attention_cache, tokens.device)
                logits = self.decoder.projected(hidden_states, vocabulary)
        return tuple(self.live.scatter(tensor) for tensor in (logits.float(), out.exit_layers.clone(), hidden_states))

    def verify(self, tokens: torch.Tensor | None, round_slots: RoundSlots) -> None:
        """The verification of a round: every draft run through the layers it skipped, with `tokens` [batch] (the last
        drafts) run through all of them; None when every row's last draft step was left unused."""
        mask, positions = round_slots.covering(self.cache.get_seq_length() + (tokens is not None))
        with profiled("speculative.verify"):
            self.decoder.verify(
                None if tokens is None else select_rows(tokens, self.live.index)[:, None], self.encoder_outputs, mask,
                self.cache, positions, round_slots.biases,
            )  # fmt: skip

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return torch.multinomial(scores.softmax(dim=-1), num_samples=1)[:, 0]
        return scores.argmax(dim=-1)

    def prefill(self, input_ids: torch.Tensor, slots: SlotMask) -> None:
        """A decoder prompt's tokens before its last, at full depth, its pads (`slots`) masked."""
        mask, positions = slots.covering(input_ids.shape[1])
        self.decoder.verify(input_ids, self.encoder_outputs, mask, self.cache, positions)

    def run_round(self, inputs: torch.Tensor, tokens: RowTokens, rows: list[int], k: int, slots: SlotMask):
        """Draft up to k tokens for each of the `rows` still generating, from `inputs` [batch] (each row's newest
        token, not yet in the cache; the pad token for the other rows, which then stop at the first exit), then
        verify them: the full model's tokens after each row's accepted drafts.

        A row stops drafting when its controller is not ready by its cap (the shallowest exit of its round so far):
        that draft would be poor, and going deeper would first run the skipped layers on its earlier drafts one
        token at a time. The verification gives the full model's token in its place. The round ends for every row
        once at most `ROUND_GOES_ON` of them still draft (`round_goes_on`)."""
        start = self.cache.get_seq_length()
        round_slots = self.round_slots(slots, start, k + 1)
        tokens.grow(max(tokens.lengths) + k + 1)
        drafting, ended_drafting = list(rows), 0
        going = torch.zeros_like(inputs, dtype=torch.bool)
        going[rows] = True
        drafts, kept, caps = [], torch.zeros_like(inputs), torch.full_like(inputs, self.depth)
        controller = CappedDraft(self.drafting.decoder, caps, self.live.index)
        settings = dataclasses.replace(self.drafting, decoder=controller)
        for offset in range(k):
            logits, exit_layers, hidden_states = self.draft(inputs, round_slots, settings)
            # The rows' scores and picks before knowing which rows drafted: a row the cap stopped throws them away.
            scores = processed(self.processors, tokens, drafting, offset, logits)
            if self.do_sample and self.drafting.draft_vocabulary is not None:
                # A row the processors left none of the vocabulary samples a uniform q (greedy's argmax needs no q).
                scores = scores.masked_fill((scores == -torch.inf).all(dim=-1, keepdim=True), 0.0)
            picked = self.pick(scores)
            capped, ends = self.draft_stops(controller.forced, picked, going)
            if capped:  # their last step's output waits for the verification; nothing of theirs is fed again
                going[list(capped)] = False
            drafting = [row for row in drafting if row not in capped]
            if not drafting:
                break
            caps = torch.minimum(caps, exit_layers)
            controller.capped_at(caps)
            tokens.write(drafting, offset, picked)
            drafts.append(Draft(picked, logits, scores, exit_layers, hidden_states))
            kept += going
            ended = {row for row in drafting if tokens.lengths[row] + offset + 1 >= self.max_length} | ends
            if ended:
                drafting = [row for row in drafting if row not in ended]
                going[list(ended)] = False
                ended_drafting += len(ended)
            inputs = torch.where(going, picked, self.pad_token_id)
            if not self.round_goes_on(drafting, len(rows), ended_drafting, tokens, offset + 1, k):
                break
        # The last drafts are fed only for rows still drafting: a row that stopped at its cap left its last step's
        # output waiting, and one that drafted its end token needs nothing after it.
        self.verify(inputs if drafting else None, round_slots)
        p_logits = self.verified_logits(drafts, start)
        p_scores = torch.stack(
            [
                processed(self.processors, tokens, rows, offset, p_logits[:, offset])
                for offset in range(len(drafts) + 1)
            ],
            dim=1,
        )
        drafted = torch.stack([draft.tokens for draft in drafts], dim=1) if drafts else inputs[:, None][:, :0]
        if self.do_sample:
            q_scores = torch.stack([draft.scores for draft in drafts], dim=1) if drafts else p_scores[:, :0]
            accepted, last = accept_sampled(drafted, q_scores, p_scores, kept)
        else:
            accepted, last = accept_greedy(drafted, p_scores, kept)
        emitted = torch.cat([drafted, last[:, None]], dim=1)
        emitted.scatter_(1, accepted[:, None], last[:, None])
        layers = [draft.exit_layers for draft in drafts] + [torch.full_like(accepted, self.depth)]
        exit_layers = torch.stack(layers, dim=1)
        exit_layers.scatter_(1, accepted[:, None], self.depth)
        return RoundResult(emitted, exit_layers, p_scores, p_logits, accepted, kept)

    def round_goes_on(
        self, drafting: list[int], rows: int, ended: int, tokens: RowTokens, drafted: int, k: int
    ) -> bool:
        """Whether a round of `rows` rows drafts another step, after `drafted` steps: while more than `ROUND_GOES_ON`
        of them still draft (`drafting`), the `ended` rows whose drafts ended uncounted while every row drafting has
        room for more than k further tokens."""
        if ended and min((self.max_length - tokens.lengths[row] - drafted for row in drafting), default=0) > k:
            rows -= ended
        return len(drafting) > ROUND_GOES_ON * rows

    def keep_rows(self, rows: list[int]) -> None:
        """The decoder's batch from now on: the call's `rows` (ascending), those still generating. The others leave,
        their cache set aside for `rejoin`: a layer costs more with more rows, and a finished row would ride along
        every later round (35-40% of a call's row-rounds at batch 8-16 on the embedded model's captions)."""
        cross = self.cache.cross_attention_cache
        # The first verification runs every layer, so each row's cross-attention K/V are cached by now and `rejoin`
        # puts the whole batch's back; a cache without them keeps every row.
        if len(rows) == len(self.live.rows) or not all(layer.is_initialized for layer in cross.layers):
            return
        device = self.encoder_outputs.last_hidden_state.device
        staying = set(rows)
        positions = [position for position, row in enumerate(self.live.rows) if row in staying]
        leaving = [position for position, row in enumerate(self.live.rows) if row not in staying]
        own = self.cache.self_attention_cache
        gone = torch.tensor(leaving, device=device)
        self.departed.append(
            DepartedRows(
                torch.tensor([self.live.rows[position] for position in leaving], device=device),
                [(layer.keys[gone], layer.values[gone]) for layer in own.layers],
                own.frontier[gone],
                own.pending[gone],
            )
        )
        if self.cross_key_values is None:
            self.cross_key_values = [(layer.keys, layer.values) for layer in cross.layers]
        kept = torch.tensor(positions, device=device)
        self.cache.batch_select_indices(kept)
        outputs = self.encoder_outputs.items()
        tensors = {name: select_rows(value, kept) for name, value in outputs if isinstance(value, torch.Tensor)}
        # The decoder reads the tensors only; the per-layer tuples stay the caller's.
        self.encoder_outputs = dataclasses.replace(self.encoder_outputs, **tensors, hidden_states=None, attentions=None)
        self.live.keep(rows, device)

    def rejoin(self) -> None:
        """Every row back in the cache, at its place in the call's batch: the departed ones as they left (their later
        slots empty: holes), the cross-attention K/V as they were."""
        if not self.departed:
            return
        own, live = self.cache.self_attention_cache, self.live
        length = own.get_seq_length()

        def whole(tensor: torch.Tensor, parts: list[torch.Tensor], dim: int, fill: int = 0) -> torch.Tensor:
            size = list(tensor.shape)
            size[0], size[dim] = live.batch, length
            batch = tensor.new_full(size, fill)
            batch[live.index] = tensor
            for rows, part in zip((group.index for group in self.departed), parts, strict=True):
                batch[(rows, *[slice(None)] * (dim - 1), slice(0, part.shape[dim]))] = part
            return batch

        for layer_idx, layer in enumerate(own.layers):
            layer.keys = whole(layer.keys, [group.key_values[layer_idx][0] for group in self.departed], 2)
            layer.values = whole(layer.values, [group.key_values[layer_idx][1] for group in self.departed], 2)
        own.frontier = whole(own.frontier, [group.frontier for group in self.departed], 1, own.num_layers)
        own.pending = whole(own.pending, [group.pending for group in self.departed], 1)
        for layer, (keys, values) in zip(self.cache.cross_attention_cache.layers, self.cross_key_values, strict=True):
            layer.keys, layer.values = keys, values

    def draft_stops(self, forced: torch.Tensor, picked: torch.Tensor, going: torch.Tensor) -> tuple[set[int], set[int]]:
        """Of a draft step's rows still `going` [batch], those its cap stopped against their controller (`forced`
        [batch]) and those of the others that drafted an end token (`picked` [batch]): in one device read."""
        ends = torch.isin(picked, self.eos_token_ids) if self.eos_token_ids is not None else torch.zeros_like(forced)
        on, at_cap, at_end = torch.stack([going, forced, ends]).tolist()
        capped = {row for row, flag in enumerate(at_cap) if flag and on[row]}
        return capped, {row for row, flag in enumerate(at_end) if flag and on[row]} - capped

    def verified_logits(self, drafts: list[Draft], start: int) -> torch.Tensor:
        """The full model's logits [batch, k + 1, vocab] after each drafted prefix and after the last draft: the
        final-layer outputs the verification left in the cache, but for the drafts that ran every layer, which
        had them (over every token, also where drafts score a draft vocabulary only)."""
        waiting = self.cache.self_attention_cache.pending[:, start : start + len(drafts) + 1]
        verified = self.live.scatter(self.decoder.exit_logits(waiting).float())  # [batch, k + 1, vocab]
        if verified.shape[1] == len(drafts):  # the last drafts were end tokens, not fed: nothing follows them
            verified = torch.cat([verified, torch.zeros_like(verified[:, :1])], dim=1)
        if not drafts:
            return verified
        ran_all = torch.stack([draft.exit_layers for draft in drafts], dim=1) >= self.depth
        if self.drafting.draft_vocabulary is None:
            draft_logits = torch.stack([draft.logits for draft in drafts], dim=1)
        elif bool(ran_all.any()):  # read on the host: projecting onto every token is what the vocabulary saves
            draft_logits = self.decoder.projected(torch.stack([draft.hidden_states for draft in drafts], dim=1)).float()
        else:
            return verified
        verified[:, :-1] = torch.where(ran_all[..., None], draft_logits, verified[:, :-1])
        return verified


@dataclass
class SpeculativeOutput:
    """What a speculative call returns: `sequences` [batch, T] (decoder input then new tokens, padded), per new token
    its `exit_layers` [batch, new] (the draft's layer for an accepted draft, the depth for the full model's own
    tokens; 0 past a row's end), per row the tokens `drafted` and `accepted` and the `rounds` it took [batch], and
    with `output_scores` /
    `output_logits` the full model's processed scores / raw logits per new token (tuples of [batch, vocab])."""

    sequences: torch.Tensor
    exit_layers: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    rounds: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None


class RoundLog:
    """Per row, what the rounds emitted: exit layers, scores and logits per new token, drafted and accepted counts.
    Past a row's end its scores and logits put all the mass on the pad token it would be fed (the full model runs
    a finished row on; speculative mode does not)."""

    def __init__(self, batch: int, keep_scores: bool, keep_logits: bool, pad_token_id: int):
        self.pad_token_id = pad_token_id
        self.exit_layers: list[list[int]] = [[] for _ in range(batch)]
        self.scores: list[list[torch.Tensor]] | None = [[] for _ in range(batch)] if keep_scores else None
        self.logits: list[list[torch.Tensor]] | None = [[] for _ in range(batch)] if keep_logits else None
        self.drafted = [0] * batch
        self.accepted = [0] * batch
        self.rounds = [0] * batch

    def add(self, row: int, result: RoundResult, index: int, exit_layer: int) -> None:
        self.exit_layers[row].append(exit_layer)
        if self.scores is not None:
            self.scores[row].append(result.scores[row, index])
        if self.logits is not None:
            self.logits[row].append(result.logits[row, index])

    def output(self, sequences: torch.Tensor) -> SpeculativeOutput:
        device = sequences.device
        longest = max(len(layers) for layers in self.exit_layers)
        exit_layers = torch.tensor([layers + [0] * (longest - len(layers)) for layers in self.exit_layers])
        return SpeculativeOutput(
            sequences,
            exit_layers.to(device),
            torch.tensor(self.drafted, device=device),
            torch.tensor(self.accepted, device=device),
            torch.tensor(self.rounds, device=device),
            self.per_step(self.scores, longest),
            self.per_step(self.logits, longest),
        )

    def per_step(self, rows: list[list[torch.Tensor]] | None, steps: int) -> tuple[torch.Tensor, ...] | None:
        """Per-row lists of [vocab] tensors as `generate`'s per-step tuple of [batch, vocab] over the first `steps`
        new tokens, a row's pad token certain past its end."""
        if rows is None:
            return None
        filler = torch.full_like(next(tensor for row in rows for tensor in row), -torch.inf)
        filler[self.pad_token_id] = 0.0
        return tuple(torch.stack([row[step] if step < len(row) else filler for row in rows]) for step in range(steps))


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer: BaseStreamer | None,
    model_kwargs: dict[str, Any],
) -> SpeculativeOutput:
    """`generate`'s greedy / sampling loop in speculative mode, on the decoder inputs `input_ids` [batch, T] (the
    decoder start token, or a decoder prompt) and `generate`'s prepared model kwargs (encoder outputs, an
    `EarlyExitCache` with `recompute`, the exit settings). A streamer gets, per position of a round's tokens, one
    [batch] tensor as from stock `generate`: the pad token for a row with no token there (finished, or fewer)."""
    pad = int(generation_config._pad_token_tensor) if generation_config._pad_token_tensor is not None else 0
    decoding = SpeculativeDecoding(
        model.get_decoder(),
        model_kwargs["past_key_values"],
        model_kwargs["encoder_outputs"],
        model_kwargs["exit_settings"],
        logits_processor,
        generation_config.do_sample,
        pad,
        generation_config._eos_token_tensor,
        generation_config.max_length,
    )
    draft_tokens = int(generation_config.num_assistant_tokens or DEFAULT_DRAFT_TOKENS)  # a NumPy integer too
    adaptive = generation_config.num_assistant_tokens_schedule in ("heuristic", "heuristic_transient")
    batch, max_length = input_ids.shape[0], generation_config.max_length
    tokens = RowTokens(input_ids, max_length + draft_tokens + 1, pad)
    slots = SlotMask(max_length, model_kwargs.get("decoder_attention_mask"))
    log = RoundLog(batch, generation_config.output_scores, generation_config.output_logits, pad)
    if input_ids.shape[1] > 1:
        decoding.prefill(input_ids[:, :-1], slots)
    generating, inputs, streamed = list(range(batch)), input_ids[:, -1], tokens.start
    while generating:
        k = max(0, min(draft_tokens, max_length - min(tokens.lengths[row] for row in generating) - 1))
        start = decoding.cache.get_seq_length()
        with profiled("speculative.round"):
            result = decoding.run_round(inputs, tokens, generating, k, slots)
        appended, still = commit_round(result, tokens, generating, log, stopping_criteria)
        if streamer is not None:
            streamed = stream(streamer, tokens, still, streamed)
        # Each row's real slots of the round: the inputs before the tokens it appended.
        crop = slots.close_round(decoding.cache.get_seq_length(), appended, start, inputs.device)
        if crop:
            decoding.cache.self_attention_cache.crop(-crop)
        last = result.tokens.gather(1, result.accepted[:, None])[:, 0]
        inputs = torch.full_like(inputs, pad)
        inputs[still] = last[still]
        if adaptive and k:
            accepted = result.accepted.tolist()  # one device read
            all_taken = all(accepted[row] == k for row in generating)
            draft_tokens = draft_tokens + 2 if all_taken else max(1, draft_tokens - 1)
        generating = still
        if generating:
            decoding.keep_rows(generating)
    if streamer is not None:
        streamer.end()
    decoding.rejoin()
    sequences = tokens.new_tokens()
    if slots.mask is not None:  # the cache the caller gets holds each row's tokens in order, as the full model's
        kept = slots.mask.clone()
        kept[:, : input_ids.shape[1]] = 1  # a padded prompt's pads keep their slots, as in the full model's cache
        if not bool(kept.all()):
            # Past a row's end wait the tokens the full model feeds there (its last token, then pads).
            ended = decoding.decoder.layer_inputs(decoding.decoder.embed_tokens(sequences[:, :-1]))
            decoding.cache.self_attention_cache.close_holes(kept, ended)
    return log.output(sequences)


def commit_round(
    result: RoundResult, tokens: RowTokens, rows: list[int], log: RoundLog, stopping_criteria
) -> tuple[list[int], list[int]]:
    """Append each row's emitted tokens one at a time, checking the stopping criteria after each on the row's own
    sequence (so a row stops exactly where the full model's loop would); returns how many tokens each row appended
    [batch] and the rows still generating."""
    # One device read of what the round gives each row: accepted and drafted counts, then its tokens' exit layers.
    counts = torch.cat([result.accepted[:, None], result.drafted[:, None], result.exit_layers], dim=1).tolist()
    accepted, drafted, exit_layers = zip(*((row[0], row[1], row[2:]) for row in counts), strict=True)
    for row in rows:
        log.drafted[row] += drafted[row]
        log.rounds[row] += 1
        count = accepted[row] + 1
        tokens.buffer[row, tokens.lengths[row] : tokens.lengths[row] + count] = result.tokens[row, :count]
    going, appended = list(rows), [0] * len(tokens.lengths)
    for index in range(result.tokens.shape[1]):
        active = [row for row in going if index <= accepted[row]]
        if not active:
            break
        for row in active:
            tokens.lengths[row] += 1
            appended[row] += 1
            log.add(row, result, index, exit_layers[row][index])
            log.accepted[row] += index < accepted[row]
        stopped = stopped_rows(stopping_criteria, tokens, active, log)
        going = [row for row in going if row not in stopped]
    return appended, going


def stopped_rows(stopping_criteria, tokens: RowTokens, rows: list[int], log: RoundLog) -> set[int]:
    """Those of the `rows` that the stopping criteria stop on their own sequences. As in stock `generate`, every
    call sees the whole batch in batch order, since a criterion may key on a row's index: one call per length
    among the rows, keeping the rows of that length; with the processed scores so far under `output_scores`."""
    stopped = set()
    for length, group in tokens.by_length(rows).items():
        done = stopping_criteria(tokens.buffer[:, :length], log.per_step(log.scores, length - tokens.start)).tolist()
        stopped.update(row for row in group if done[row])
    return stopped


def stream(streamer, tokens: RowTokens, generating: list[int], streamed: int) -> int:
    """Put, as stock `generate` puts a step's tokens, one [batch] tensor per position from `streamed` to the last
    one every row still `generating` has reached (to the end once none is): each row's token there, the pad token
    past a finished row's end. Rows that accepted more wait for the others. Returns the positions now streamed."""
    reached = min((tokens.lengths[row] for row in generating), default=max(tokens.lengths))
    if reached <= streamed:
        return streamed
    device = tokens.buffer.device
    positions = torch.arange(streamed, reached, device=device)
    ends = torch.tensor(tokens.lengths, device=device)
    columns = torch.where(positions[None] < ends[:, None], tokens.buffer[:, streamed:reached], tokens.pad_token_id)
    for column in columns.T.contiguous().cpu():  # one copy to the host per round
        streamer.put(column)
    return reached


__all__ = [
    "DEFAULT_DRAFT_TOKENS",
    "SpeculativeDecoding",
    "SpeculativeOutput",
    "accept_greedy",
    "accept_sampled",
    "speculative_generate",
]
