"""TensorFlow Serving's gRPC API (tensorflow.serving.PredictionService and ModelService) for predict artifacts."""
