"""The softmax kernel family behind ``fuseml.ops.softmax`` / ``log_softmax``.

rows:      rows that fit on chip, one read and one write (one program per row or tile of
           short rows; the longest on a persistent grid).
long_rows: longer rows, split over several programs that exchange their (max, sum), or
           streamed twice (online softmax) past that.
strided:   softmax over a non-last dim without a transposing copy.
"""
