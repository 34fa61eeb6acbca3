"""kdexp.report"""
