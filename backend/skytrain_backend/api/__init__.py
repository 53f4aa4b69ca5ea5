"""skytrain_backend.api."""
