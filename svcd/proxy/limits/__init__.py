"""
Rate limits: the per-organization limiter in Redis (D5) and the circuit
breaker that keeps a failing Redis cheap (D10).
"""
