"""kdexp.data"""
