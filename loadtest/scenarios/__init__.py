"""The scenarios ``python -m loadtest`` runs."""
