"""dmattn's benchmark: dmattn beside its peers on the same device (``python -m dmattn.bench``,
or ``dmattn-bench``; cli.py says what it does and takes).

The modules, each on the ones above it in this list only:

* ``config``: a row's configuration, inputs and result (Config, Inputs, make_inputs, Row);
* ``timing``: time_ms, back_to_back_ms, cuda_graph_of (also for benchmarks/profiling/);
* ``suites``: the configurations of each suite, CPU and GPU, and their selection;
* ``providers``: dmattn and the peers, each a function of a configuration and its inputs;
* ``check``: dmattn's output and its rows' q / alpha gradients against a float64 reference, every
  gradient against a peer's (and the peer's rows against the reference where they disagree);
* ``report``: the results as a dict, the Markdown table and the summary line;
* ``plots``: the PNG plots of a results dict (``python -m dmattn.bench.plots`` redraws a run's);
* ``run``: one configuration through every provider;
* ``cli``: the command line (main);
* ``doge``: Doge's per-query top-k attention and a transformers Doge training step, beside
  their peers (``python -m dmattn.bench.doge``; CUDA only).
"""

from .cli import main
from .config import Config, Inputs, Row, make_inputs
from .run import fwd_bwd, run_config
from .suites import SUITES, cpu_configs, gpu_configs, select_configs
from .timing import back_to_back_ms, cuda_graph_of, time_ms

__all__ = ["main", "Config", "Inputs", "Row", "make_inputs", "fwd_bwd", "run_config", "SUITES", "cpu_configs",
           "gpu_configs", "select_configs", "back_to_back_ms", "cuda_graph_of", "time_ms"]
