"""Who may send what: API keys, class grants, tenants (caps, shares, metrics), rpm/tpm limits and the token accounting
behind them.
"""
