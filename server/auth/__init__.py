"""Who a token belongs to: verifiers, signing keys, the verified-token cache."""
