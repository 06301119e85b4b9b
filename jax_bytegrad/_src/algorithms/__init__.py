"""One package per algorithm, each registering its entries with ``registry.py`` when imported.

The imports below run in Bagua's documented order, which is the order users see (the names an
unknown algorithm's error lists, ``ALGORITHMS``). A new algorithm is one
package here and one import below.
"""

# isort: off
from jax_bytegrad._src.algorithms import bytegrad as bytegrad  # gradient_allreduce, bytegrad
from jax_bytegrad._src.algorithms import qadam as qadam
from jax_bytegrad._src.algorithms import decentralized as decentralized  # and low_precision_
from jax_bytegrad._src.algorithms import asynchronous as asynchronous  # async
from jax_bytegrad._src.algorithms import diloco as diloco  # not Bagua's: last
# isort: on
