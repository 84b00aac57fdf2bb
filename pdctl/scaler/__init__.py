"""The scaler: observe (metrics) -> decide (pure policy) -> act (SSH + router), in a loop."""
