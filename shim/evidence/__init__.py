"""Evidence: audit records and traces, written off the hot path."""
