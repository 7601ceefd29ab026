"""The engine: plan a call (group requests, pick backends by cost), keep it inside memory, warm
it up, cache its compilations."""
