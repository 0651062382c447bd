"""The front end: regions in a model, strategies as Python, capture of a model into region graphs,
and imports of other tools' schedules."""
