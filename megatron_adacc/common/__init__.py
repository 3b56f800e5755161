"""The vocabulary every layer shares: sites, byte units, plain-data plans and costs, the one-line
error."""
