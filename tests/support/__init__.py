"""What several test files share: helpers that start, drive and read the real parts (engines, gateways, Redis,
KMock, the chart), each module named for what it helps with. Test files import from here, never from each other."""
