"""The vocabulary every layer shares: sites, byte units, plans, costs, the one-line error."""
