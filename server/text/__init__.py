"""Text: tokenizers, chat templates and incremental detokenization."""
