"""Model adapters: vLLM model classes that build latent attention when
compression is on and are the stock classes otherwise."""
