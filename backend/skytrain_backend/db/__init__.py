"""skytrain_backend.db."""
