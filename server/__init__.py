"""hloserve.server: OpenAI- and TF-Serving-compatible HTTP serving of artifacts."""
