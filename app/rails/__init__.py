"""HTTP clients for the PSP and the rail: derived keys in, one of three answers out."""
