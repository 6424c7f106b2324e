"""Version workarounds for the model frameworks, kept in one place."""
