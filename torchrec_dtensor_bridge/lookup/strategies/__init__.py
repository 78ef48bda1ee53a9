"""One module per way of combining a table's shards across ranks, each behind :class:`..plan.Strategy`.

* :mod:`.whole` - every rank of the group holds the whole table (replicated): each looks up its own
  batch on its own copy; gradients summed across ranks.
* :mod:`.columns` - every block spans all rows (table-wise, column-wise, table-column-wise): each
  (bag, column) is computed by one rank; one ``all_to_all`` hands every rank its bags' columns.
* :mod:`.rows` - rows are cut (row-wise, table-row-wise, grid): a bag's sum is spread over ranks; ids
  are routed to the rank holding their row, the partial sums reduce-scattered (max pooling: :mod:`.row_max`;
  a route by masks where the rows do not partition the table: :mod:`.row_route`).

:mod:`.copies` holds what the last two share: replicated blocks (several copies of one box) keep equal
gradients. :func:`..functional.pick_strategy` picks a table's strategy from its layout.
"""

from .columns import COLUMNS
from .rows import ROWS
from .whole import WHOLE

__all__ = ["COLUMNS", "ROWS", "WHOLE"]
