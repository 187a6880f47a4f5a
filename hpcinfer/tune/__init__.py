"""hpcinfer tune: measure configurations on a sample of the user's own data and pick the best."""
