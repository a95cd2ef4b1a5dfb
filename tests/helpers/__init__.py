"""What the tests share: models and references, tolerances, servers, calls, waits (no tests here)."""
