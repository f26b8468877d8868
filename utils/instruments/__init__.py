"""The depth instruments, as library code: what each measures over the residual stream of a causal LM.

    angular     angular distance d(l, n) and block influence
    variance    variance and RMS of the stream at every depth
    jacobian    block Jacobians' distance from the identity
    logit_lens  the model's own readout applied after every layer
    removal     a decoder layer removed, for good or for a block

Their command lines (utils/angular_analysis.py, variance_analysis.py, jacobian_analysis.py, layer_remove.py) and the
reports that combine them (utils/depth_report.py, the studies) import these; no script imports another.
"""
