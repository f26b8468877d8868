"""The depth instruments, as library code: what each measures over the residual stream of a causal LM.

    angular        angular distance d(l, n) and block influence
    variance       variance and RMS of the stream at every depth
    jacobian       block Jacobians' distance from the identity
    logit_lens     the model's own readout applied after every layer
    stream         one pass of the stream feeding all of the above at once, and the update ratio
    removal        a decoder layer removed, for good or for a block
    removal_sweep  each layer removed in turn and the model evaluated with lm-eval
    removal_loss   each layer removed in turn and the next-token loss measured
    norm_gains     the gains of the model's norms
    measure        every instrument on one loaded model in one call (measure_model)

and two helpers the tools share:

    model_io          load a model and tokenizer (ours or the hub's), feed text, read the residual stream
    model_arithmetic  parameters, model FLOPs per token, GPU peaks and the paper's micro-batches, by formula (for
                      the benchmarks, the GPU check, the memory estimate and the studies)

Their command lines (utils/angular_analysis.py, variance_analysis.py, jacobian_analysis.py, layer_remove.py) and the
reports that combine them (utils/depth_report.py, the studies' utils/study/analyse.py) import these; no script imports
another, and no library module imports a script (tests/test_cli.py).
"""
