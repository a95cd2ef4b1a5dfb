"""Model loading, the served-model registry, and scoring with a loaded model."""
