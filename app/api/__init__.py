"""The HTTP surface: routes, dependencies and problem+json errors. No SQL, no commit."""
