"""The fuzz search: campaigns that find every distinct failure within a budget, parallel jobs, failure signatures,
the search at a served layer's shape, and the fuzz report."""
