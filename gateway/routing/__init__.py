"""Which engine serves a request: the signals (scorers), the strategies `--routing` names, and the pick."""
