"""Sampling: parameters, logits -> probabilities, draft sampling, transport, rejection sampling."""
from specdec.sampling.counters import SpecCounters
from specdec.sampling.draft import draft_sample
from specdec.sampling.params import SamplingParams, SamplingParamsError
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rejection import (HostSpecOutput, SpecOutput, one_hot_probs, rejection_sample,
                                        rejection_sample_probs)
from specdec.sampling.transport import (EncodedProbs, ProbsDecodeError, decode_probs, encode_probs,
                                        normalize, round_probs)

__all__ = ["SamplingParams", "SamplingParamsError", "SamplingTensors", "logits_to_probs",
           "draft_sample", "rejection_sample", "rejection_sample_probs", "SpecOutput", "HostSpecOutput",
           "one_hot_probs", "SpecCounters", "EncodedProbs", "ProbsDecodeError", "encode_probs",
           "decode_probs", "normalize", "round_probs"]
