"""skytrain_backend.worker."""
