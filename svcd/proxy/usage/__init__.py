"""
What forwarded requests cost and where their record goes (decisions D12):
the models' prices and the cost of an answer in nano-dollars.
"""
