"""Model card templates (`string.Template`, `$name` fields) that `hf_earlyexit.publishing` fills at publish time."""
