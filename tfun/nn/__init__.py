"""`tfun.nn`: recurrent and state-space layers built on `tfun.lax`.

- torch.nn drop-ins: `RNN`, `LSTM`, `GRU`, `RNNCell`, `LSTMCell`, `GRUCell` (one
  `tfun.lax.scan` per layer and direction; torch's parameters, so `state_dict`s interchange).
- State-space / linear-recurrent layers, each with `init_state` / `step` for inference:
  `S4D`, `S5`, `LRU`, `MinGRU`, `Mamba`, and the `selective_scan` op under Mamba.
- `chunked_cross_entropy`: a linear + cross-entropy loss that never materializes the logits.
"""

from ._loss import chunked_cross_entropy as chunked_cross_entropy
from ._mamba import Mamba as Mamba
from ._rnn import GRU as GRU
from ._rnn import LSTM as LSTM
from ._rnn import RNN as RNN
from ._rnn import GRUCell as GRUCell
from ._rnn import LSTMCell as LSTMCell
from ._rnn import RNNCell as RNNCell
from ._selective_scan import selective_scan as selective_scan
from ._ssm import LRU as LRU
from ._ssm import S4D as S4D
from ._ssm import S5 as S5
from ._ssm import MinGRU as MinGRU

__all__ = [
    "RNN",
    "LSTM",
    "GRU",
    "RNNCell",
    "LSTMCell",
    "GRUCell",
    "S4D",
    "S5",
    "LRU",
    "MinGRU",
    "Mamba",
    "selective_scan",
    "chunked_cross_entropy",
]
