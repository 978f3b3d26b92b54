"""vLLM-free engine-side logic of the connector: daemon link, scheduler planning, worker transfers."""
