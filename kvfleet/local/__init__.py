"""kvfleet on one machine: `kvfleet up` (fleet.py: an embedded Redis, engines and a gateway), `kvfleet up
--kubernetes` (cluster.py: the real operator and gateway against KMock's API emulator, kube_emulator.py and
kube_tables.py, with a kubelet of local processes, kubelet.py), the process supervisor they share (supervisor.py),
the embedded Redis (redis_server.py) and vLLM on this machine (vllm.py: its managed install and one engine's
command).

Part of the composition root: it may import every component; no component imports it."""
