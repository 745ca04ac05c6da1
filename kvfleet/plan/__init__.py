"""`kvfleet plan`: size a fleet from a request log (maxModelLen, KV memory, maxNumSeqs, replicas) and check an
InferenceFleet against it, with the engine's capacity arithmetic and the replay's engine model."""
