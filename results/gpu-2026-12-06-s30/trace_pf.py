"""decode_gpu.py --trace with decoder.PREFETCH set first: trace_pf.py MODE [decode_gpu args]."""
import runpy, sys
from forge_ml.backends.cuda import decoder
decoder.PREFETCH = sys.argv[1]
sys.argv = ["benchmarks/decode_gpu.py"] + sys.argv[2:]
runpy.run_path("benchmarks/decode_gpu.py", run_name="__main__")
