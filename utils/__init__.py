"""Analysis tools: model loading, residual-stream capture, angular distance, variance."""
