"""What operators see: Prometheus metrics (``metrics``, served by ``listener`` on a port of
their own), the series read from the database at scrape time (``collector``), and structured
logs that carry one request id from the gateway to the engine (``logs``)."""
