"""skytrain_backend.scheduler."""
