"""Memory: the measures under which a run fits, chosen from the summary's estimate before the first step.

    measures.py      the measures, one class each: what it saves, what it costs, when it is
                     allowed and how it is applied; MEASURES, the one table of them
    plan.py          the planner: the cheapest set of measures that fits the budget (pure arithmetic)
    planning.py      the plan on a run: its footprint, what it rules out, the measures put in place,
                     the stop before the first step when nothing fits, the next measure after an OOM
    strategy.py      DDP or FSDP under strategy="auto", and the line that says so
    optimizers.py    the optimizer rebuilt for the optimizer measures (torchao's states, bf16 rounding)
    blocks.py        the model's repeated blocks, and activation checkpointing of some of them
    chunked_loss.py  a Hugging Face causal LM's cross-entropy a chunk of the sequence at a time
    in_backward.py   the optimizer's step fused into backward, one parameter at a time
"""
