"""Model-server engines: DraftEngine.propose and TargetEngine.verify over a ModelRunner (no gRPC)."""
from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.engine.types import (Code, DraftOutput, DraftSeqInput, ModelInfo, SeqError, SeqFailure,
                                  StepResult, StepTiming, VerifyOutput, VerifySeqInput)

__all__ = ["Code", "DraftEngine", "DraftOutput", "DraftSeqInput", "ModelInfo", "SeqError", "SeqFailure",
           "StepResult", "StepTiming", "TargetEngine", "VerifyOutput", "VerifySeqInput"]
