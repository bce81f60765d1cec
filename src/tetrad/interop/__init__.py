"""What users already have: Hugging Face Llama checkpoints and tokenizers, in and out."""
