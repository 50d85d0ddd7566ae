"""HTTP wire formats: the OpenAI API and TensorFlow Serving's REST API over FastAPI."""
