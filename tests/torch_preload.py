"""What the fork server of the gloo test processes imports once (:func:`torch_cases.run_distributed`).

Every process of a launch used to start a fresh interpreter and import torch, its distributed package,
shardplan and transformers itself (about 5 CPU seconds each, measured: 36 processes in the main suite,
8 in tests/torch_hf5). The fork server imports them once per pytest process; each gloo process is then a
fork of it and runs the same code on the same, freshly imported modules (nothing here runs a model, sets
a seed or starts a thread: each case seeds its own generator, see ``torch_cases.run_case``). Measured on
tests/torch_hf5: 405 -> 316 CPU seconds.
"""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.distributed.tensor.debug  # noqa: F401
import torch.distributed.tensor.experimental  # noqa: F401
import torch.export  # noqa: F401
import torch.utils.checkpoint  # noqa: F401
# what torch.export and DTensor import on their first call (every launch's trace and run: measured by listing the
# modules each launch's rank 0 imported, 11 launches of tests/torch_engine)
import torch._functorch.aot_autograd  # noqa: F401
import torch._functorch.partitioners  # noqa: F401
import torch.export._trace  # noqa: F401
import torch.fx.experimental.validator  # noqa: F401
import torch.nn.attention.bias  # noqa: F401
import torch.utils._runtime_estimation  # noqa: F401
import torch.utils.flop_counter  # noqa: F401

import shardplan.cost.budget  # noqa: F401
import shardplan.fit  # noqa: F401
import shardplan.pipeline.api  # noqa: F401
import shardplan.pipeline.execute  # noqa: F401
import shardplan.pipeline.floors  # noqa: F401
import shardplan.pipeline.search  # noqa: F401
import shardplan.pipeline.stages  # noqa: F401
import shardplan.search.constrained  # noqa: F401
import shardplan.spmd  # noqa: F401
import shardplan.torch  # noqa: F401
import shardplan.torch.device  # noqa: F401
import shardplan.torch.frontend  # noqa: F401
import shardplan.torch.run  # noqa: F401
import shardplan.torch.saved  # noqa: F401
import shardplan.torch.staged  # noqa: F401
import shardplan.units  # noqa: F401
import torch_cases

# transformers imports torchvision where it is installed (tests/torch_hf5's environment): entered first, as
# the cases enter it (torch_cases.enter_torchvision)
if torch_cases.enter_torchvision():
    torch_cases.timm_module()
    # that environment's launch (tests/torch_hf5) builds every model of torch_cases.HF_CASES: their modules once here
    import transformers

    for _model in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                   "Gemma2ForCausalLM", "PhiForCausalLM", "OPTForCausalLM", "GPTNeoXForCausalLM", "FalconForCausalLM",
                   "BloomForCausalLM", "T5ForConditionalGeneration", "RobertaForMaskedLM", "MixtralForCausalLM",
                   "Qwen2MoeForCausalLM"):
        getattr(transformers, _model)  # the lazy module imports the model's modeling file
import transformers.modeling_utils  # noqa: F401, E402
import transformers.models.gpt2.modeling_gpt2  # noqa: F401, E402
import transformers.models.llama.modeling_llama  # noqa: F401, E402
