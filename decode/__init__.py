"""draftsmith.decode."""
