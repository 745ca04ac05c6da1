import cProfile
import pstats
import sys
import time

import torch

torch.set_num_threads(2)
from bench.workload import anyscale_workload
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams

n=int(sys.argv[1]) if len(sys.argv)>1 else 64
eng=LLMEngine(EngineConfig(max_model_len=2048, max_num_seqs=256, kv_cache_memory=16384*46080), show_progress=False)
eng.generate([[100]*32], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
reqs=anyscale_workload(n)
for i,r in enumerate(reqs):
    eng.add_request(str(i), r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0))
pr=cProfile.Profile(); t=time.perf_counter(); pr.enable()
while eng.has_unfinished_requests(): eng.step()
pr.disable(); dt=time.perf_counter()-t
print(f"{dt:.1f}s {sum(r.output_len for r in reqs)/dt:.1f} tok/s")
st=pstats.Stats(pr); st.sort_stats('cumulative')
import io

s=io.StringIO(); st.stream=s; st.print_stats('kvfleet|torch._C|built-in'); print("\n".join(s.getvalue().splitlines()[:60]))
