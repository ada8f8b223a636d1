"""The float64 reference, checked against first principles one function at a time."""
