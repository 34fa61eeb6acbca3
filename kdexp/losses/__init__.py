"""kdexp.losses"""
