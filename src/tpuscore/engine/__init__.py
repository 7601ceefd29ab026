"""The engine: run a call (`runner.Engine`: validate, plan, run), plan it (group requests, pick
backends by cost), keep it inside memory, warm it up, cache its compilations."""
